"""Write tests/goldens/vllm/vllm_events.json: KV-event messages as vLLM 0.34.0's own publisher sends them, which
tests/unit/engines/test_vllm_events.py and the `kvc events --engine vllm` tests publish again on a ZeroMQ PUB
socket (without vLLM).

Run once, with vLLM's venv (vLLM installed without a GPU: everything used here runs on the CPU), from the
repository root:

    /work/venvs/vllm/bin/python tests/goldens/vllm/make_vllm_events.py

Everything is vLLM's: its scheduler-side `KVCacheManager` with prefix caching and KV events on (block size 4,
one full-attention group, sha256 block hashes from `get_request_block_hasher`, the NONE_HASH of vLLM's fixed
seed) records the events as requests are allocated and freed, the way the scheduler drives it: two requests of
one salted tenant (the second reuses two blocks and asks for the "full" KV-cache report, so the reused blocks are
announced again), a salted request with a LoRA adapter and a session, an unsalted one with an image, one of
prompt embeddings, then an allocation that evicts every cached block, and `reset_prefix_cache`. The KV
offloading connector's events come from its own `OffloadingEventsTracker` (self-describing payloads), fed the
`OffloadingEvent`s its tiers emit: the CPU tier's store of the first request's first chunk (`cpu/manager.py`),
the same chunk stored by the KVCR secondary tier (STORAGE, ownership "kvcr", `tiering/kvcr/manager.py`) and by a
local file-system tier (STORAGE, locality LOCAL, `tiering/fs/manager.py`), and KVCR's removal of it; as the
scheduler does (`Scheduler.update_from_output`), the connector's events follow the cache manager's in the step's
`KVEventBatch`. Each batch goes through vLLM's `ZmqEventPublisher` (PUB on loopback, with a replay socket and a
topic), and the messages are read back from its replay socket exactly as it frames them.

The scenario runs twice: with vLLM's default int block hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: a digest's
last 8 bytes as an unsigned int, `maybe_convert_block_hash`) for "messages", and with bytes hashes (=0: the whole
digest) for "bytes_messages". The JSON keeps each message's frames (hex), the replay answer's framing, and what
was put in (prompts, salts, LoRA, the block-hash digests vLLM computed for each request), so the tests can check
the hashes kvc prints against vLLM's. Re-run it when vLLM's event format changes; commit the JSON it writes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import zmq
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
    get_offloading_event_group_spec,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    make_offload_key,
)
from vllm.v1.request import Request

OUT = Path(__file__).resolve().parent / "vllm_events.json"
BLOCK_SIZE = 4
CHUNK_BLOCKS = 2  # the offloading connector moves chunks of two blocks
NUM_BLOCKS = 12  # the GPU pool (one of them vLLM's null block): small, so one long request evicts every cached block
HASH = "sha256"  # vLLM's default prefix_caching_hash_algo
TOPIC = "kv@vllm"
IMAGE = "c2f0a1e5d6b7image-golden"  # an image's mm hash (the encoder cache's identifier)
# (rid, cache_salt, LoRA name or None, tokens (None: prompt embeddings), {extra}): the salts are what the tests make
# sure `kvc events` never prints; one token past the last full block, as a prompt is (vLLM caches full blocks only)
REQUESTS = [
    ("a", "golden-salt-A7q", None, list(range(100, 113)), {}),
    ("b", "golden-salt-A7q", None, list(range(100, 108)) + [900, 901, 902, 903, 7], {"report": "full"}),
    ("c", "golden-salt-B3x", "adapter-x", list(range(100, 113)), {"session": "sess-42"}),
    ("d", None, None, [11, 12] + [0] * 4 + [13, 14, 15], {"image": (2, 4)}),  # an image at tokens 2..5
    ("f", None, None, None, {"embeds": 9}),  # prompt embeddings (9 positions), no token ids
    ("e", None, None, list(range(500, 541)), {}),  # 11 blocks: takes the whole pool back
]


def _request(rid: str, salt: str | None, lora: str | None, tokens: list[int] | None, extra: dict, hasher) -> Request:
    params = SamplingParams(max_tokens=1, extra_args={"kv_cache_report_mode": extra["report"]}
                            if "report" in extra else None)
    mm = None
    if "image" in extra:
        offset, length = extra["image"]
        mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=IMAGE,
                                    mm_position=PlaceholderRange(offset=offset, length=length))]
    embeds = torch.linspace(-1, 1, extra["embeds"] * 8).reshape(extra["embeds"], 8) if "embeds" in extra else None
    return Request(rid, tokens, params, None, cache_salt=salt, block_hasher=hasher, mm_features=mm,
                   prompt_embeds=embeds, lora_request=LoRARequest(lora, 1, f"/loras/{lora}") if lora else None,
                   session_id=extra.get("session"))


def steps() -> tuple[list[KVEventBatch], list[dict]]:
    """The event batches of the scenario, one per scheduler step, as vLLM's cache manager and offloading
    connector recorded them; and the requests with the block-hash digests vLLM computed for them."""
    hash_fn = get_hash_fn_by_name(HASH)
    init_none_hash(hash_fn)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
                             enable_caching=True, enable_kv_cache_events=True)
    group_spec = get_offloading_event_group_spec(config.kv_cache_groups[0])
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, True), {0: group_spec})
    group = GroupOffloadConfig(group_idx=0, tokens_per_block=BLOCK_SIZE, tokens_per_chunk=CHUNK_BLOCKS * BLOCK_SIZE,
                               hashes_per_chunk=CHUNK_BLOCKS, kv_event_group_spec=group_spec,
                               sliding_window_size_in_chunks=None, kv_cache_spec=spec,
                               manager_cls=FullAttentionManager)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)

    def step(offloading: tuple[OffloadingEvent, ...] | list[OffloadingEvent] = ()) -> KVEventBatch:
        return KVEventBatch(ts=time.time(), events=manager.take_events() + list(tracker.take_events(offloading)))

    manager.reset_prefix_cache()
    out = [step()]  # AllBlocksCleared
    made = {}
    for rid, salt, lora, tokens, extra in REQUESTS:
        req = made[rid] = _request(rid, salt, lora, tokens, extra, hasher)
        computed, hits, _ = manager.get_computed_blocks(req)
        assert manager.allocate_slots(req, req.num_tokens - hits, hits, computed) is not None, rid
        offloading = []
        if rid == "e":  # KVCR's G3 inventory dropped the first request's chunk (ownership: the tier)
            offloading = [OffloadingEvent(keys=[_chunk_key(made["a"])], medium=Medium.STORAGE, removed=True,
                                          ownership="kvcr", removal_expected=True)]
        out.append(step(offloading))
        if rid == "a":  # the first request finished: its first chunk goes to the CPU tier, then on to storage
            key = _chunk_key(req)
            tracker.record_store(req, group, 0, key)
            out.append(step([
                OffloadingEvent(keys=[key], medium=Medium.CPU, removed=False, removal_expected=True),
                OffloadingEvent(keys=[key], medium=Medium.STORAGE, removed=False, ownership="kvcr",
                                removal_expected=True),
                OffloadingEvent(keys=[key], medium=Medium.STORAGE, removed=False, locality=Locality.LOCAL),
            ]))
        manager.free(req)
    manager.free(made["e"])
    assert manager.reset_prefix_cache()
    out.append(step())  # AllBlocksCleared
    requests = [{"rid": rid, "cache_salt": salt, "lora_name": lora, "tokens": list(made[rid].all_token_ids),
                 "block_hashes": [h.hex() for h in made[rid].block_hashes],
                 # the digest of each block's embeddings vLLM mixed into its hash (a prompt of embeddings only)
                 "prompt_embeds_digests": [d.hex() for _, d in sorted(made[rid]._prompt_embeds_per_block_hashes
                                                                      .items())]}
                for rid, salt, lora, tokens, _ in REQUESTS]
    return out, requests


def _chunk_key(req: Request) -> bytes:
    """The offloading connector's key of a request's first chunk: its last block's hash, with the group."""
    return make_offload_key(req.block_hashes[CHUNK_BLOCKS - 1], 0)


def publish(batches: list[KVEventBatch]) -> list[list[bytes]]:
    """The batches through vLLM's ZmqEventPublisher; its replay socket's answer to a request from 0, as framed."""
    ctx = zmq.Context()
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://127.0.0.1:*",
                                  replay_endpoint="tcp://127.0.0.1:*", topic=TOPIC)
    assert publisher._replay is not None
    replay = publisher._replay.getsockopt_string(zmq.LAST_ENDPOINT)  # where it bound (any free port)
    for batch in batches:
        publisher.publish(batch)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    answers: list[list[bytes]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the publisher thread may not have sent them all yet: ask again
        answers = []
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(10_000):
            frames = dealer.recv_multipart()
            answers.append(frames)
            if frames[2] == ZmqEventPublisher.END_SEQ:
                break
        if len(answers) == len(batches) + 1:
            break
    publisher.shutdown()
    ctx.destroy(linger=0)
    assert len(answers) == len(batches) + 1, f"got {len(answers)} replay frames for {len(batches)} batches"
    return answers


def main() -> None:
    assert "PYTHONHASHSEED" not in os.environ, "unset PYTHONHASHSEED: the goldens use vLLM's fixed NONE_HASH seed"
    import vllm

    runs = {}
    for name, int_hashes in (("messages", "1"), ("bytes_messages", "0")):
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = int_hashes  # read by vLLM at each conversion
        batches, requests = steps()
        runs[name] = publish(batches)
    doc = {
        "vllm_version": vllm.__version__,
        "block_size": BLOCK_SIZE,
        "hash": HASH,
        "topic": TOPIC,
        "image": IMAGE,
        "requests": requests,
        # each message as the PUB socket sends it: [topic, seq, payload]; the replay socket's answer to a DEALER
        # is [b"", topic, seq, payload] per batch, then [b"", b"", -1, b""]
        "messages": [[f.hex() for f in frames[1:]] for frames in runs["messages"][:-1]],
        "replay_end": [f.hex() for f in runs["messages"][-1]],
        "bytes_messages": [[f.hex() for f in frames[1:]] for frames in runs["bytes_messages"][:-1]],
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(doc['messages'])} + {len(doc['bytes_messages'])} messages to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
