"""kvcache/kvdata.py: synthetic KV is a function of the page hash, and the check finds every wrong page."""

import numpy as np
import pytest
import torch

from factories import make_layout
from kvcache import KVLayout, Namespace, RadixKey, SyntheticKV, page_hashes

NS = Namespace("t1", "s")


def _hashes(layout, tokens, ns=NS):
    return page_hashes(layout.layout_id, RadixKey.of(tokens, ns), layout.page_size, b"c" * 32)


def _pool(layout, n_pages):
    return torch.zeros((n_pages, layout.bytes_per_page), dtype=torch.uint8)


@pytest.mark.parametrize("layout", [make_layout(4), KVLayout("odd", 1, 1, 3, "float16", page_size=2)],
                         ids=["word-rows", "byte-rows"])
def test_written_pages_check_clean_and_are_deterministic(layout):
    kv = SyntheticKV(layout)
    hashes = _hashes(layout, range(8 * layout.page_size))
    rows = _pool(layout, 16)
    pages = np.array([9, 2, 15, 0, 4, 7, 11, 3])
    kv.write(rows, pages, hashes)
    assert kv.mismatches(rows, pages, hashes).tolist() == []
    assert kv._mismatches_on_device(rows, pages, hashes).tolist() == []
    rows[15, 5] ^= 1  # pages[2]
    assert kv.mismatches(rows, pages, hashes).tolist() == [2]
    assert kv._mismatches_on_device(rows, pages, hashes).tolist() == [2]
    rows[15, 5] ^= 1
    assert torch.equal(kv.pages(hashes), SyntheticKV(layout).pages(hashes))
    assert torch.equal(rows[torch.from_numpy(pages)], kv.pages(hashes))


def test_rows_of_one_page_differ_so_a_reordered_page_is_caught():
    layout = make_layout(4)
    kv = SyntheticKV(layout)
    page = kv.pages(_hashes(layout, range(4)))[0].view(4, -1)
    assert len({bytes(r.numpy()) for r in page}) == 4


@pytest.mark.parametrize("path", ["cpu-digest", "device-compare"])
def test_wrong_namespace_wrong_layout_wrong_slot_and_one_flipped_byte_are_mismatches(path):
    layout = make_layout(4)
    kv = SyntheticKV(layout)
    if path == "device-compare":  # the element-wise path a GPU pool takes, run here on CPU tensors
        kv.mismatches = kv._mismatches_on_device
    tokens = list(range(16))
    mine = _hashes(layout, tokens)
    rows = _pool(layout, 8)
    # pages 0..3 hold another salt's KV for the same tokens, 4..7 the right namespace's
    kv.write(rows, np.arange(4), _hashes(layout, tokens, Namespace("t1", "other")))
    kv.write(rows, np.arange(4, 8), mine)
    assert kv.mismatches(rows, np.arange(4), mine).tolist() == [0, 1, 2, 3]
    other_layout = make_layout(4, model="test-model@r2")
    assert len(kv.mismatches(rows, np.arange(4, 8), _hashes(other_layout, tokens))) == 4
    assert kv.mismatches(rows, np.array([5, 4, 6, 7]), mine).tolist() == [0, 1]  # two slots swapped
    rows[6, 37] ^= 1
    assert kv.mismatches(rows, np.arange(4, 8), mine).tolist() == [2]


def test_check_spans_many_chunks():
    layout = KVLayout("big", 4, 2, 64, "float16", page_size=16)  # 32 KiB pages: 32 per 1 MiB chunk
    kv = SyntheticKV(layout)
    hashes = _hashes(layout, range(100 * 16))
    rows = _pool(layout, 100)
    kv.write(rows, np.arange(100), hashes)
    rows[77, -1] ^= 0xFF
    assert kv.mismatches(rows, np.arange(100), hashes).tolist() == [77]
    assert kv._mismatches_on_device(rows, np.arange(100), hashes).tolist() == [77]


def test_digest_is_of_the_prescribed_page_and_survives_the_cache_reset(monkeypatch):
    import xxhash

    import kvcache.workload.kvdata

    layout = make_layout(4)
    kv = SyntheticKV(layout)
    hashes = _hashes(layout, range(40))
    assert kv.digest(hashes[3]) == xxhash.xxh3_128_intdigest(kv.pages([hashes[3]]).numpy())
    monkeypatch.setattr(kvcache.workload.kvdata, "_DIGEST_CACHE", 4)
    digests = [kv.digest(h) for h in hashes]
    assert len(kv._digests) <= 4 and digests == [SyntheticKV(layout).digest(h) for h in hashes]
