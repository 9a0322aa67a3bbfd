"""kvcache.ledger.kv: a pool's page bytes as spans, over kvc's own tensor or an engine's per-layer tensors."""

import numpy as np
import pytest
import torch

from devices import TEST_DEVICE
from kvcache import InvalidConfig
from kvcache.ledger.kv import KVPages, KVSpan

LAYERS, HEADS, DIM, PS = 3, 2, 4, 4


def engine_kv(slots=16, dtype=torch.float16, mla=False, v_dim=DIM):
    """Per-layer K and V (or MLA latents) as an engine holds them, filled with distinct values."""
    gen = torch.Generator().manual_seed(slots)
    k = [torch.randn(slots, HEADS, DIM, generator=gen).to(dtype).to(TEST_DEVICE) for _ in range(LAYERS)]
    v = None if mla else [torch.randn(slots, HEADS, v_dim, generator=gen).to(dtype).to(TEST_DEVICE)
                          for _ in range(LAYERS)]
    return k, v


def kv_layer_page(k, v, page):
    """What a page of these tensors is in the kv_layer arrangement: K layer by layer, then V, each page_size tokens,
    as bytes — computed independently of KVPages."""
    parts = [t[page * PS:(page + 1) * PS].cpu().contiguous().view(torch.uint8).reshape(-1) for t in [*k, *(v or [])]]
    return torch.cat(parts).numpy()


def test_own_pool_is_one_span_as_wide_as_a_page():
    kv = KVPages.own(6, PS, 24, TEST_DEVICE)
    assert kv.owned and kv.arrangement == "token" and kv.num_pages == 6 and kv.page_bytes == PS * 24
    assert kv.spans == [KVSpan(0, PS * 24)] and kv.device.type == torch.device(TEST_DEVICE).type


@pytest.mark.parametrize("mla", [False, True])
def test_layer_first_views_are_the_engines_own_bytes_and_read_in_kv_layer_order(mla):
    k, v = engine_kv(mla=mla)
    kv = KVPages.layer_first(k, v, PS)
    per_tensor = PS * HEADS * DIM * 2
    assert not kv.owned and kv.arrangement == "kv_layer" and kv.num_pages == 4
    assert [s.width for s in kv.spans] == [per_tensor] * (LAYERS if mla else 2 * LAYERS)
    assert kv.views[0].data_ptr() == k[0].data_ptr()  # a view, never a copy
    got = kv.read(np.array([2, 0]))
    assert np.array_equal(got[0], kv_layer_page(k, v, 2)) and np.array_equal(got[1], kv_layer_page(k, v, 0))
    k[1][2 * PS] += 1  # the engine writes its tensor: kvc sees it
    assert not np.array_equal(kv.read(np.array([2]))[0], got[0])


def test_write_lands_in_the_engines_tensors_and_slots_past_the_last_page_are_left_alone():
    k, v = engine_kv(slots=18)  # 4 whole pages and 2 slots the engine keeps
    kv = KVPages.layer_first(k, v, PS)
    assert kv.num_pages == 4
    tail = [t[16:].clone() for t in k]
    rows = np.random.default_rng(1).integers(0, 256, (2, kv.page_bytes), dtype=np.uint8)
    kv.write(np.array([3, 1]), rows)
    assert np.array_equal(kv_layer_page(k, v, 3), rows[0]) and np.array_equal(kv_layer_page(k, v, 1), rows[1])
    assert all(torch.equal(t[16:], before) for t, before in zip(k, tail, strict=True))


def test_k_and_v_of_different_widths_are_spans_of_different_widths():
    k, v = engine_kv(v_dim=2 * DIM)
    kv = KVPages.layer_first(k, v, PS)
    assert [s.width for s in kv.spans] == [PS * HEADS * DIM * 2] * LAYERS + [PS * HEADS * 2 * DIM * 2] * LAYERS


def test_pair_cuts_a_one_span_side_to_the_other_sides_spans():
    k, v = engine_kv()
    engine = KVPages.layer_first(k, v, PS)
    host = KVPages.own(4, PS, engine.page_bytes // PS)
    pairs = engine.pair(host)
    assert len(pairs) == 2 * LAYERS
    for (dev, hv), span in zip(pairs, engine.spans, strict=True):
        assert hv.shape == dev.shape and hv.storage_offset() == span.offset
    def ids(ps):
        return [(a.data_ptr(), a.storage_offset(), b.data_ptr(), b.storage_offset()) for a, b in ps]
    assert ids((b, a) for a, b in host.pair(engine)) == ids(pairs)
    with pytest.raises(InvalidConfig, match="pages of"):
        engine.pair(KVPages.own(4, PS, 8))


@pytest.mark.parametrize("tensors, message", [
    (([torch.zeros(8, 2, 4)], [torch.zeros(8, 2, 4)] * 2), "one K tensor per layer"),
    (([torch.zeros(8, 4, 2).transpose(1, 2)], None), "contiguous"),
    (([torch.zeros(8, 2, 4), torch.zeros(9, 2, 4)], None), "slots first"),
])
def test_tensors_kvc_cannot_take_as_they_are_are_refused_with_the_reason(tensors, message):
    with pytest.raises(InvalidConfig, match=message):
        KVPages.layer_first(*tensors, PS)
