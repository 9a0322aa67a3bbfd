"""Write tests/goldens/sglang/sglang_events.json: KV-event messages as SGLang 0.5.23's own publisher sends them, which
tests/unit/engines/test_sglang_events.py and the `kvc events --engine sglang` tests publish again on a ZeroMQ PUB
socket (without SGLang).

Run once, with SGLang's venv (per ../shared/peer-bench/README.md), from the repository root:

    PYTHONPATH=/work/shared/peer-bench/stubs /work/peer/venv/bin/python tests/goldens/sglang/make_sglang_events.py

Everything is SGLang's: a `RadixCache` with KV events on (page size 4) records them as requests of two salted
tenants, one with an extra_key, and an unsalted one are inserted, one node is backed up to the host pool
(`StorageMedium.CPU`) and the tree is evicted; each step's events go through SGLang's `ZmqEventPublisher` (PUB on
loopback, with a replay socket and a topic), and the messages are read back from its replay socket exactly as it
frames them. The JSON keeps each message's frames (hex), the replay answer's framing, and what was put in
(prompts, salts, the storage keys SGLang computed for them), so the tests can check hashes against
`kvcache.engines.sglang_keys`. Re-run it when SGLang's event format changes; commit the JSON it writes.
"""

from __future__ import annotations

import json
import sys
import time
from array import array
from pathlib import Path

import torch
import zmq
from sglang.srt.disaggregation.kv_events import KVEventBatch, StorageMedium, ZmqEventPublisher
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

OUT = Path(__file__).resolve().parent / "sglang_events.json"
PAGE_SIZE = 4
TOPIC = "kv@sglang"
# (extra_key, cache_salt, tokens): the salts are what the tests make sure `kvc events` never prints
REQUESTS = [
    (None, "golden-salt-A7q", list(range(100, 112))),
    (None, "golden-salt-A7q", list(range(100, 108)) + [900, 901, 902, 903]),  # shares two pages with the first
    ("tenant-b", "golden-salt-B3x", list(range(100, 108))),  # same tokens, another namespace
    (None, None, list(range(500, 516))),  # no salt: its block hashes are its storage keys' first 64 bits
]


class _Allocator:
    """What the simulated cache frees on eviction: nothing to free here."""

    device = "cpu"

    def free(self, idx):
        pass

    def free_segment(self, idx, start_pos=0):
        pass


def steps() -> list[KVEventBatch]:
    """The event batches of the scenario, one per scheduler step, as SGLang's cache recorded them."""
    cache = RadixCache.create_simulated(mock_allocator=_Allocator(), page_size=PAGE_SIZE, enable_kv_cache_events=True)
    out = [KVEventBatch(ts=time.time(), events=cache.take_events())]  # the reset's AllBlocksCleared
    slot = 0
    for extra_key, salt, tokens in REQUESTS:
        key = RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=salt)
        cache.insert(InsertParams(key=key, value=torch.arange(slot, slot + len(tokens), dtype=torch.int64)))
        slot += len(tokens)
        out.append(KVEventBatch(ts=time.time(), events=cache.take_events()))
    # HiCache backs a node up to the host pool: the same pages, stored on CPU_PINNED
    node = next(iter(cache.root_node.children.values()))
    cache.kv_events.record_store(node, medium=StorageMedium.CPU)
    out.append(KVEventBatch(ts=time.time(), events=cache.take_events()))
    cache.evict(EvictParams(num_tokens=cache.evictable_size()))
    out.append(KVEventBatch(ts=time.time(), events=cache.take_events()))
    return out


def main() -> None:
    ctx = zmq.Context()
    publisher = ZmqEventPublisher(attn_dp_rank=0, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                  topic=TOPIC, bind=True)
    replay = publisher._local_replay_endpoint  # where it bound (any free port): SGLang keeps it for /server_info
    assert replay is not None
    batches = steps()
    for batch in batches:
        publisher.publish(batch)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    answers: list[list[bytes]] = []
    deadline = time.monotonic() + 60
    while len(answers) <= len(batches) and time.monotonic() < deadline:  # the publisher thread may lag: ask again
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
    import sglang

    doc = {
        "sglang_version": sglang.__version__,
        "page_size": PAGE_SIZE,
        "topic": TOPIC,
        "requests": [{"extra_key": e, "cache_salt": s, "tokens": t,
                      "storage_keys": get_storage_hash_str(RadixKey(array("q", t), extra_key=e, cache_salt=s), None,
                                                           page_size=PAGE_SIZE)} for e, s, t in REQUESTS],
        # each message as the PUB socket sends it: [topic, seq, payload]; the replay socket's answer to a DEALER
        # is [b"", topic, seq, payload] per batch, then [b"", b"", -1, b""]
        "messages": [[f.hex() for f in frames[1:]] for frames in answers[:-1]],
        "replay_end": [f.hex() for f in answers[-1]],
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(doc['messages'])} messages to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
